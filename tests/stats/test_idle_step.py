"""A step of `StatsEngine` looks only at the buffers fed since the last step: a step in which nothing is logged
costs nothing per buffer of the session (the quality bar's "zero cost when idle"), and the rows of a step are
still emitted in the buffers' creation order whatever order the feeds came in."""

from __future__ import annotations

import torch

from tedebug.stats import StatsEngine
from tedebug.stats.buffers import StatBuffer

from support.features import RecordingSink

STATS = ("min", "max")
LAYERS = ("a", "b", "c", "d")


def _counting_clears(monkeypatch):
    calls = []
    clear = StatBuffer.clear

    def counted(self):
        calls.append(self.key.layer)
        clear(self)

    monkeypatch.setattr(StatBuffer, "clear", counted)
    return calls


def _feed(engine, layers, iteration):
    for i, layer in enumerate(layers):
        engine.feed(layer, "activation", STATS, torch.full((2, 3), float(LAYERS.index(layer) + i)), iteration=iteration)


def test_a_step_without_feeds_touches_no_buffer(monkeypatch):
    engine = StatsEngine(RecordingSink())
    _feed(engine, LAYERS, 0)
    engine.step(0)
    clears = _counting_clears(monkeypatch)
    for iteration in range(1, 4):  # nothing logged: no buffer is cleared, nothing is emitted
        engine.step(iteration)
    assert clears == []
    _feed(engine, ("c", "a"), 4)
    engine.step(4)
    assert sorted(clears) == ["a", "c"]  # only the two fed buffers


def test_rows_come_out_in_creation_order():
    log = RecordingSink()
    engine = StatsEngine(log)
    _feed(engine, LAYERS, 0)
    engine.step(0)
    _feed(engine, ("d", "b", "a"), 1)  # another order, one buffer not fed
    engine.step(1)
    step1 = [name for name, _, iteration in log.rows if iteration == 1]
    assert step1 == ["a_activation_min", "a_activation_max", "b_activation_min", "b_activation_max",
                     "d_activation_min", "d_activation_max"]  # fmt: skip
    values = {name: value for name, value, iteration in log.rows if iteration == 1}
    assert values["d_activation_min"] == 3.0 and values["b_activation_min"] == 2.0 and values["a_activation_min"] == 2.0
