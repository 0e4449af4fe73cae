"""A logged tensor's fast paths keep their promise, pinned by counting calls (never by timing):

- every `*_enabled` answer of a session whose features share one schedule evaluates that schedule once per iteration
  (`tedebug.plan.ScheduleClock`), whatever the number of layers and tensors, and the values logged follow each
  section's own schedule; the clocks live and die with their session;
- a staged CPU feed of LogTensorStats runs no Python of `tedebug.stats` beyond `StatsEngine.feed` and
  `HostBatch.stage`, and the step spends one snapshot and one clear per fed buffer there, and no row merge for a
  buffer's first row; the logged values are torch's own reductions of the fed tensors.
"""

from __future__ import annotations

import math
import os
import sys
from collections import Counter

import torch

from tedebug import active, debug_api
from tedebug.config.schedule import Schedule
from tedebug.nn import Linear
from tedebug.compiled_formulas import FORMULAS_FILE
from tedebug.stats.definitions import StatRequest

from support.features import RecordingSink, debug_session

STATS_DIR = os.path.dirname(sys.modules["tedebug.stats"].__file__)


def _two_sections(freq_b: int) -> dict:
    """Layer "a": LogTensorStats at freq 1 on all six tensors; layer "b": the same at `freq_b`."""
    tensors = ["activation", "weight", "output", "dgrad", "wgrad", "gradient"]

    def one(regex, freq):
        return {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": regex},
            "transformer_engine": {
                "LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": tensors, "freq": freq}
            },
        }

    return {"a": one("^a$", 1), "b": one("^b$", freq_b)}


def _run(layers, x, steps):
    for _ in range(steps):
        for layer in layers:
            layer(x).sum().backward()
        debug_api.step()


def test_one_schedule_query_per_distinct_schedule_and_iteration(tmp_path, monkeypatch):
    queried = []
    real_query = Schedule.query

    def query(self, iteration):
        queried.append((self.freq, iteration))
        return real_query(self, iteration)

    monkeypatch.setattr(Schedule, "query", query)
    a, b = Linear(4, 3, name="a"), Linear(4, 3, name="b")
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    sink = RecordingSink()
    with debug_session(_two_sections(freq_b=2), tmp_path, sink):
        _run([a, b], x, 3)
        noted = dict(active.session().stats._next_iter)
    # 12 tensors ask every iteration at which their layer runs the debug path: one query per schedule there
    # (layer b's gate skips iteration 1, its next debug iteration being 2)
    assert sorted(queried) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 2)]
    assert noted == {"a": 3, "b": 4}  # each layer's next iteration recorded, as its feature would
    logged = sink.values()
    assert sorted(i for (name, i) in logged if name == "a_activation_max") == [0, 1, 2]
    assert sorted(i for (name, i) in logged if name == "b_activation_max") == [0, 2]
    assert logged[("a_activation_max", 1)] == 3.0 and logged[("b_weight_max", 2)] == b.weight.detach().max().item()


def test_every_schedule_evaluated_once_per_iteration_across_layers(tmp_path, monkeypatch):
    """One section selecting two layers: per iteration, one evaluation for the twelve tensors' enabled answers and
    one per LogTensorStats plan (one plan per tensor name serves both layers)."""
    evaluated = Counter()
    real = Schedule.is_active

    def is_active(self, iteration):
        evaluated[iteration] += 1
        return real(self, iteration)

    monkeypatch.setattr(Schedule, "is_active", is_active)
    config = _two_sections(freq_b=1)
    config["a"]["layers"] = {"layer_name_regex_pattern": "^[ab]$"}
    del config["b"]
    sink = RecordingSink()
    with debug_session(config, tmp_path, sink):
        _run([Linear(4, 3, name="a"), Linear(4, 3, name="b")], torch.ones(1, 4, requires_grad=True), 3)  # with dgrad
    assert evaluated == {0: 1 + 6, 1: 1 + 6, 2: 1 + 6}
    assert len(sink.values()) == 2 * 6 * 3


def test_schedule_clocks_belong_to_their_session(tmp_path):
    """A second session with another schedule and the same iteration numbers follows its own schedule."""
    layer = Linear(4, 3, name="a")
    x = torch.ones(1, 4)
    first, second = RecordingSink(), RecordingSink()
    with debug_session(_two_sections(freq_b=1), tmp_path / "one", first):
        _run([layer], x, 4)
    config = _two_sections(freq_b=1)
    config["a"]["transformer_engine"]["LogTensorStats"]["freq"] = 3
    with debug_session(config, tmp_path / "two", second):
        _run([layer], x, 4)
    assert sorted(i for (name, i) in first.values() if name == "a_output_max") == [0, 1, 2, 3]
    assert sorted(i for (name, i) in second.values() if name == "a_output_max") == [0, 3]


def _stats_calls(fn) -> Counter:
    """The Python functions of `tedebug.stats` (and the statistics formulas it generates) that `fn()` calls, counted
    by qualified name."""
    calls: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call" and (
            frame.f_code.co_filename.startswith(STATS_DIR) or frame.f_code.co_filename == FORMULAS_FILE
        ):
            calls[frame.f_code.co_qualname] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_a_staged_feed_and_its_step_make_no_other_stats_calls(tmp_path):
    names = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]
    requests = tuple(StatRequest.parse_hp(name, tensor_name="activation") for name in names)
    generator = torch.Generator().manual_seed(14)
    tensors = [torch.randn(8, 32, generator=generator) for _ in range(5)] + [torch.randn(4, 96, generator=generator)]
    sink = RecordingSink()
    with debug_session(_two_sections(freq_b=1), tmp_path, sink):
        engine = active.session().stats

        def feed_all(iteration):
            for i, t in enumerate(tensors):
                engine.feed(f"L{i}", "activation", requests, t, iteration=iteration, options=(1,))

        feed_all(0)  # the first step builds the buffers, their formulas and gathers
        debug_api.step()
        feeds = _stats_calls(lambda: feed_all(1))
        step = _stats_calls(debug_api.step)
        debug_api.step()  # the rows of iteration 1 are written now (one step behind)
    assert feeds == {"StatsEngine.feed": 6, "HostBatch.stage": 6}
    per_buffer = {name: count for name, count in step.items() if count >= len(tensors)}
    assert per_buffer == {
        # (no snapshot object per buffer: every buffer holds one host row, so the step is read back through the
        # layout kept from the last step, `readback.StepLayout`, which checks each buffer's one row once)
        "_row_kind": 6,
        "StatBuffer.clear": 6,
        # the final formulas: one generated function per buffer (`row_evaluator`), all eight statistics in it
        "values_of": 6,
        # the staged rows' column pick (`StatBuffer.host_gather`), once per buffer
        "StatBuffer.host_gather.<locals>.<lambda>": 6,
        # the "fed since the last step" test, twice per buffer: when the step lists the fed buffers, and when the
        # staged row is replayed (a first row is kept as it is)
        "StatBuffer.fed": 12,
    }
    assert "StatBuffer.accumulate_host" not in step  # a buffer's first row is kept as it is
    values = sink.values()
    for i, t in enumerate(tensors):
        x = t.double()
        expected = {
            "min": t.min().item(),
            "max": t.max().item(),
            "mean": (x.sum() / x.numel()).item(),
            "std": x.std().item(),
            "l1_norm": x.abs().sum().item(),
            "l2_norm": math.sqrt(x.square().sum().item()),
            "cur_amax": t.abs().max().item(),
        }
        for stat, value in expected.items():
            assert math.isclose(values[(f"L{i}_activation_{stat}", 1)], value, rel_tol=1e-12), (i, stat)
        assert math.isclose(
            values[(f"L{i}_activation_dynamic_range", 1)],
            math.log2(t.abs().max().item()) - math.log2(t.abs().min().item()),
            rel_tol=1e-12,
        )
