"""`tools/sample_step.py`: py-spy's raw stacks split by phase and thread, and the per-step times it reports, on a
hand-written stack file whose counts give the expected figures; a machine without py-spy gets a message."""

from __future__ import annotations

import pytest

from support.tools import load_tool

MAIN = "thread (7): MainThread;<module> (tools/sample_step.py:250);child (tools/sample_step.py:90)"
DEBUG = MAIN + ";child.<locals>.phase_debug (tools/sample_step.py:80);train_step (tedebug/bench.py:303)"
PLAIN = MAIN + ";child.<locals>.phase_plain (tools/sample_step.py:77);train_step (tedebug/bench.py:303)"
CALL = "Module._wrapped_call_impl (torch/nn/modules/module.py:1773)"
GROUP = "inspect_group (tedebug/debug_quantization.py:146)"
STACKS = [
    f"{DEBUG};{CALL};_inspected_linear (tedebug/nn/base.py:499) 30",
    f"{DEBUG};{CALL};_inspected_linear (tedebug/nn/base.py:512);{GROUP} 10",
    f"{PLAIN};{CALL} 20",
    "thread (7);<module> (tools/sample_step.py:3) 5",  # start-up, before py-spy read the thread's name: left out
    f"thread (9): Dummy-1;_inspect_backward (tedebug/nn/base.py:543);{GROUP} 8",
]


@pytest.fixture
def raw(tmp_path):
    path = tmp_path / "stacks.txt"
    path.write_text("\n".join(STACKS) + "\n")
    return str(path)


def test_stacks_split_by_phase_and_thread(raw):
    tool = load_tool("sample_step")
    tallies = tool.tally(tool.read_raw(raw), ["_inspected_linear"])
    debug, plain, other = tallies["phase_debug"], tallies["phase_plain"], tallies[tool.OTHER_THREADS]
    assert (debug.total, plain.total, other.total) == (40, 20, 8)
    assert debug.parts == {"Module._wrapped_call_impl (modules/module.py)": 40}
    assert debug.own == {"_inspected_linear (nn/base.py)": 30, "inspect_group (tedebug/debug_quantization.py)": 10}
    assert debug.inclusive["_inspected_linear (nn/base.py)"] == 40
    callees, by_line = debug.lines["_inspected_linear"]
    assert callees == {"(own time)": 30, "inspect_group (tedebug/debug_quantization.py)": 10}
    assert by_line == {"line 499": 30, "line 512": 10}
    assert other.own == {"inspect_group (tedebug/debug_quantization.py)": 8}


def test_report_gives_microseconds_per_step(raw, capsys):
    tool = load_tool("sample_step")
    assert tool.main(["--report", raw, "--steps", "2", "4", "--rate", "1000", "--lines", "_inspected_linear"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # 40 samples at 1000 per second over 4 logged steps: 10 ms per step; autograd's thread counted per logged step
    assert "== phase_debug: 40 samples over 4 steps, 10000 us per step sampled" in lines
    assert "== phase_plain: 20 samples over 2 steps, 10000 us per step sampled" in lines
    assert "== other threads: 8 samples over 4 steps, 2000 us per step sampled" in lines
    assert "      7500.0  _inspected_linear (nn/base.py)" in lines  # its own time
    assert "      2500.0   25.0 %  -> inspect_group (tedebug/debug_quantization.py)" in lines
    assert "      7500.0   75.0 %  at line 499" in lines


def test_without_py_spy_the_tool_says_so(monkeypatch):
    tool = load_tool("sample_step")
    monkeypatch.setattr(tool.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="needs the py-spy executable"):
        tool.main(["--device", "cpu"])
