"""Statistics launches grouped per layer call (`tedebug.stats.launch_group`), on the CPU with a stand-in kernel
backend: a backend that writes each statistics row at its slab address (as `cupy_stats` does on the GPU) with the
torch reference's values, and records its launches.

- the queue: nothing deferred outside a group; inside, launches wait until `GROUP_MAX` are queued or the group
  closes, then go out one launch per device and dtype in feed order (one tensor through the lone launch); an inner
  group joins the outer one;
- a tedebug `Linear` logging its six tensors launches once in its forward (activation, weight, output) and once in
  its backward (gradient, dgrad, wgrad), and logs exactly what the same run logs with every tensor launched alone.
"""

import ctypes
import threading
import types

import pytest
import torch

import tedebug
from tedebug import debug_api
from tedebug.backends import torch_ref
from tedebug.stats import engine as engine_module
from tedebug.stats import launch_group

STATS = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]
TENSORS = ["activation", "weight", "gradient", "output", "wgrad", "dgrad"]


def _write_row(x: torch.Tensor, address: int) -> None:
    """The statistics row of `x` (numel, then the basic partials) written at `address`, as the kernels write it."""
    row = torch.tensor((float(x.numel()),) + torch_ref.basic_partial_values(x.detach()), dtype=torch.float64)
    ctypes.memmove(address, row.data_ptr(), 8 * row.numel())


@pytest.fixture
def launches(monkeypatch):
    """Every launch of the stand-in backend: ("lone", [numel]) or ("group", [numels]) in launch order."""
    calls = []

    def lone(x, address):
        calls.append(("lone", [x.numel()]))
        _write_row(x, address)

    def group(items):
        calls.append(("group", [x.numel() for x, _ in items]))
        for x, address in items:
            _write_row(x, address)

    backend = types.SimpleNamespace(
        BASIC_ROW_KEYS=torch_ref.BASIC_ROW_KEYS, basic_stats_into=lone, basic_stats_group_into=group
    )
    monkeypatch.setattr(engine_module, "backend_for", lambda tensor: backend)
    return calls


def test_the_queue():
    calls = []
    lone = lambda x, address: calls.append(("lone", x.item(), address))  # noqa: E731
    group = lambda items: calls.append(("group", [(x.item(), a) for x, a in items]))  # noqa: E731
    f32 = [torch.tensor([float(i)]) for i in range(5)]
    f64 = torch.tensor([9.0], dtype=torch.float64)
    assert launch_group.pending() is None  # no group: the engine launches at once
    opened = launch_group.open_group()
    assert opened and launch_group.pending() == []
    assert launch_group.open_group() is False  # an inner group joins the open one
    launch_group.close_group(False)  # ... and its close leaves the queue alone
    launch_group.submit(group, lone, f32[0], 100)
    launch_group.submit(group, lone, f64, 101)
    assert calls == [] and len(launch_group.pending()) == 2  # waiting for the group
    launch_group.submit(group, lone, f32[1], 102)  # the third: the queue goes out, one launch per dtype
    assert calls == [("group", [(0.0, 100), (1.0, 102)]), ("lone", 9.0, 101)] and launch_group.pending() == []
    calls.clear()
    for i in (2, 3, 4):
        launch_group.submit(group, lone, f32[i], 100 + i)
    assert calls == [("group", [(2.0, 102), (3.0, 103), (4.0, 104)])]
    calls.clear()
    launch_group.submit(None, lone, f32[3], 8)  # a backend without a group launch: at once, group or not
    assert calls == [("lone", 3.0, 8)] and launch_group.pending() == []
    calls.clear()
    launch_group.submit(group, lone, f32[0], 7)
    launch_group.close_group(opened)  # the leftover goes out at the close, through the lone launch
    assert calls == [("lone", 0.0, 7)] and launch_group.pending() is None
    launch_group.submit(group, lone, f32[1], 9)  # no group open: at once
    assert calls == [("lone", 0.0, 7), ("lone", 1.0, 9)]
    calls.clear()
    other = lambda items: calls.append(("other", [(x.item(), a) for x, a in items]))  # noqa: E731
    opened = launch_group.open_group()
    launch_group.submit(group, lone, f32[0], 1)
    launch_group.submit(other, lone, f32[1], 2)  # another backend's group launch: not in the same launch
    launch_group.submit(group, lone, f32[2], 3)
    assert calls == [("group", [(0.0, 1), (2.0, 3)]), ("lone", 1.0, 2)]
    launch_group.close_group(opened)


def test_a_group_is_its_threads_own():
    """A group open on one thread (the forward's) does not hold the launches of another (autograd's device thread,
    which feeds the backward's tensors): there they go out at once, or into that thread's own group."""
    calls = []
    lone = lambda x, address: calls.append(("lone", address))  # noqa: E731
    group = lambda items: calls.append(("group", [a for _, a in items]))  # noqa: E731
    x = torch.zeros(1)
    opened = launch_group.open_group()
    launch_group.submit(group, lone, x, 1)
    seen = []

    def other():
        seen.append(launch_group.pending())  # a thread that never opened a group
        launch_group.submit(group, lone, x, 2)  # at once
        inner = launch_group.open_group()
        seen.append(inner)
        launch_group.submit(group, lone, x, 3)
        launch_group.submit(group, lone, x, 4)
        launch_group.close_group(inner)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [None, True]
    assert calls == [("lone", 2), ("group", [3, 4])]
    assert [a for *_, a in launch_group.pending()] == [1]  # this thread's queue, untouched
    launch_group.close_group(opened)
    assert calls[-1] == ("lone", 1) and launch_group.pending() is None


def _run(tmp_path, name):
    """One training step of a tedebug Linear logging its six tensors; returns the lines of the JSONL log."""
    torch.manual_seed(3)
    layer = tedebug.nn.Linear(32, 24, name="lin")
    x = torch.randn(2, 8, 32, requires_grad=True)
    config = {
        "s": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": ".*"},
            "transformer_engine": {"LogTensorStats": {"enabled": True, "stats": STATS, "tensors": TENSORS, "freq": 1}},
        }
    }
    debug_api.initialize(config, log_dir=str(tmp_path / name))
    try:
        y = layer(x)
        (y * torch.linspace(-1, 1, 24)).sum().backward()
        debug_api.step()
    finally:
        debug_api.end_debug()
    logs = list((tmp_path / name).rglob("*.jsonl"))
    assert len(logs) == 1
    return logs[0].read_text().splitlines()


_BACKEND_FOR = engine_module.backend_for  # the real one (the fixture replaces it)


def test_a_layer_launches_once_per_direction(tmp_path, launches, no_debug_session, monkeypatch):
    grouped = _run(tmp_path, "grouped")
    numels = {"activation": 16 * 32, "weight": 24 * 32, "output": 16 * 24}
    assert launches == [
        ("group", [numels["activation"], numels["weight"], numels["output"]]),
        ("group", [numels["output"], numels["activation"], numels["weight"]]),  # gradient, dgrad, wgrad
    ]
    launches.clear()
    monkeypatch.setattr(launch_group, "open_group", lambda: False)  # no group: every tensor launched at its feed
    alone = _run(tmp_path, "alone")
    assert [kind for kind, _ in launches] == ["lone"] * 6
    assert len(grouped) == 6 * len(STATS) and grouped == alone
    monkeypatch.setattr(engine_module, "backend_for", _BACKEND_FOR)  # the CPU's own path: the same lines
    assert _run(tmp_path, "cpu") == grouped
