"""The hot-path caches of an active debug iteration: they live in the session (or its stats engine / sinks), never
outlive it, never change an answer (schedules still answer per iteration, mutated configs are re-parsed, a stats
buffer still refuses other stats within a step), and the fast encoders write exactly what the plain ones wrote."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
import torch

from tedebug import debug_api
from tedebug.feature_support import cached_schedule, exact_key, memoized
from tedebug.sinks.base import MetricLogger, Sink
from tedebug.sinks.jsonl import JsonlSink, make_record
from tedebug.sinks.text import TextStatsSink
from tedebug.stats import StatRequest, StatsEngine

from test_features_helpers import RecordingSink, debug_session, section

TABS = " \t\t\t\t "
ASCTIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"


def stats_config(**schedule):
    return section({"LogTensorStats": {"enabled": True, "stats": ["min", "max"], "tensors": ["activation"],
                                       **schedule}})


# ------------------------------------------------------------------------------------------------ exact_key
def test_exact_key_separates_types_and_keeps_order():
    assert exact_key(1) != exact_key(1.0) and exact_key(1) != exact_key(True) and exact_key(1.0) != exact_key(True)
    assert exact_key([1, 2]) != exact_key((1, 2))
    assert exact_key([1, 2]) != exact_key([2, 1])
    assert exact_key([[1, 2]]) != exact_key([[1, True]])
    assert exact_key({"a": 1, "b": 2}) != exact_key({"b": 2, "a": 1})
    assert exact_key(["min", {"max_blockwise_dynamic_range": {"block_size": 4}}]) == \
        exact_key(["min", {"max_blockwise_dynamic_range": {"block_size": 4}}])
    assert exact_key(None) is None and exact_key("x") == "x"
    with pytest.raises(TypeError):
        exact_key([object(), {1, 2}])


def test_memoized_needs_a_session_and_is_per_session(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return len(calls)

    assert memoized("t", ("k",), compute) == 1 and memoized("t", ("k",), compute) == 2  # no session: no memo
    with debug_session(stats_config(), tmp_path / "a"):
        first = debug_api.session()
        assert memoized("t", ("k",), compute) == 3 and memoized("t", ("k",), compute) == 3
        assert memoized("t", ("k", 1.0), compute) == 4  # another key (1.0 is not 1)
        assert memoized("t", ["unhashable", {1}], compute) == 5 and memoized("t", ["unhashable", {1}], compute) == 6
    assert first.memo("t") == {}  # dropped at end_debug
    with debug_session(stats_config(), tmp_path / "b"):
        assert debug_api.session() is not first and debug_api.session().memo("t") == {}
        assert memoized("t", ("k",), compute) == 7  # the new session recomputes


# ------------------------------------------------------------------------------------------------ schedules
def hand_schedule(iteration, freq, start, end):
    """Oracle: (active, next active) for one [start, end] interval, counted by brute force."""
    def active(i):
        return i % freq == 0 and start <= i and (end is None or i <= end)
    nxt = next((i for i in range(iteration + 1, iteration + 10 * freq + 1) if active(i)), None)
    return active(iteration), nxt


def test_cached_schedule_still_answers_per_iteration(tmp_path):
    with debug_session(stats_config(freq=3, start_step=2, end_step=13), tmp_path) as te:
        answers = [te.inspect_tensor_enabled("fc1", tensor_name="activation", iteration=i) for i in range(16)]
        assert answers == [hand_schedule(i, 3, 2, 13) for i in range(16)]
        assert answers[3] == (True, 6) and answers[12] == (True, None) and answers[0] == (False, 3)
        assert len(debug_api.session().memo("schedule")) == 1  # parsed once for all 16 calls


def test_cached_schedule_follows_a_mutated_config(tmp_path):
    config = {"freq": 2}
    with debug_session(stats_config(), tmp_path):
        assert cached_schedule(config).query(3) == (False, 4)
        config["freq"] = 5
        assert cached_schedule(config).query(3) == (False, 5)
        config["freq"] = 5.0  # an invalid value is not served from the entry of freq=5
        with pytest.raises(ValueError, match="freq"):
            cached_schedule(config)


# ------------------------------------------------------------------------------------------------ stats engine
class Capture:
    def __init__(self):
        self.records = []

    def log_scalar(self, name, value, iteration, **kw):
        self.records.append((name, value, iteration))


def test_engine_request_cache_and_identity_fast_path_keep_the_checks():
    log = Capture()
    engine = StatsEngine(log)
    x = torch.tensor([1.0, -2.0, 4.0])
    requests = (StatRequest("min", "min"), StatRequest("max", "max"))
    engine.feed("L", "activation", requests, x, iteration=0)
    engine.feed("L", "activation", requests, 2 * x, iteration=0)  # same tuple object: parsed once
    with pytest.raises(ValueError, match="one buffer must get the same stats every feed"):
        engine.feed("L", "activation", (StatRequest("mean", "mean"),), x, iteration=0)
    engine.step(0)
    assert log.records == [("L_activation_min", -4.0, 0), ("L_activation_max", 8.0, 0)]
    stats = ["min"]
    engine.feed("L", "gradient", stats, x, iteration=1)
    engine.step(1)
    stats[0] = "max"  # a mutated list is parsed again
    engine.feed("L", "gradient", stats, x, iteration=2)
    engine.step(2)
    assert log.records[2:] == [("L_gradient_min", -2.0, 1), ("L_gradient_max", 4.0, 2)]
    assert engine._request_cache
    engine.reset()
    assert not engine._request_cache


def test_two_sessions_do_not_share_caches(tmp_path):
    x = torch.arange(1.0, 5.0)
    sink_a, sink_b = RecordingSink(), RecordingSink()
    with debug_session(stats_config(), tmp_path / "a", sink_a) as te:
        te.inspect_tensor_enabled("fc1", tensor_name="activation")
        te.inspect_tensor("fc1", tensor=x, tensor_name="activation", iteration=0)
        first = debug_api.session()
        assert first.memo("schedule") and first.memo("LogTensorStats.feed") and first.stats._request_cache == {}
        debug_api.step()
    config = section({"LogTensorStats": {"enabled": True, "stats": ["mean", "cur_amax"], "tensors": ["activation"]}})
    with debug_session(config, tmp_path / "b", sink_b) as te:
        assert debug_api.session().memo("LogTensorStats.feed") == {}
        te.inspect_tensor_enabled("fc1", tensor_name="activation")
        te.inspect_tensor("fc1", tensor=-x, tensor_name="activation", iteration=0)
        debug_api.step()
    assert sink_a.values() == {("fc1_activation_min", 0): 1.0, ("fc1_activation_max", 0): 4.0}
    assert sink_b.values() == {("fc1_activation_mean", 0): -2.5, ("fc1_activation_cur_amax", 0): 4.0}


def test_plan_lines_and_feature_messages_are_written_once(tmp_path):
    layer = torch.nn.Linear(4, 4)
    import tedebug

    model = tedebug.convert_model(torch.nn.Sequential(layer))
    x = torch.randn(3, 4)
    with debug_session(stats_config(), tmp_path):
        for _ in range(3):
            model(x).sum().backward()
            debug_api.step()
        path = debug_api.session().text_log.path
        assert debug_api.session().log_message("unhashable extra", "L", logging.INFO, [1]) is True
        assert debug_api.session().log_message("unhashable extra", "L", logging.INFO, [1]) is False
        assert debug_api.session().log_message("plain", None) is True
        assert debug_api.session().log_message("plain", None) is False
    text = open(path, encoding="utf-8").read()
    plan_lines = re.findall(r"Tensor: activation, gemm (\w+) - (.+)", text)
    assert plan_lines == [("fprop", "High Precision"), ("wgrad", "High Precision")]
    assert text.count("API=look_at_tensor_before_process: activation") == 1
    assert text.count("unhashable extra") == 1 and text.count("plain") == 1


# ------------------------------------------------------------------------------------------------ sinks
JSON_VALUES = [0.1, -0.0, 0.0, 1e300, 5e-324, 2.5, 3, True, float("nan"), float("inf"), -float("inf"),
               torch.tensor(0.75, dtype=torch.float64)]


def test_jsonl_fast_lines_equal_json_dumps(tmp_path):
    path = tmp_path / "s.jsonl"
    sink = JsonlSink(str(path))
    expected = []
    for names in (("L_activation_max", "L", "activation", "max"), ("odd \"name\"\n\u00e9", None, "t", None)):
        for iteration, value in enumerate(JSON_VALUES * 2):  # the second round uses the cached name part
            sink.log_scalar(names[0], value, iteration, layer=names[1], tensor=names[2], stat=names[3])
            expected.append(json.dumps(make_record(names[0], value, iteration, layer=names[1], tensor=names[2],
                                                   stat=names[3]), allow_nan=False))
    sink.log_scalars([("b", 1.5, 4, "x", "y", "z"), ("b", float("nan"), 5, "x", "y", "z")])
    expected += ['{"iteration": 4, "name": "b", "layer": "x", "tensor": "y", "stat": "z", "value": 1.5}',
                 '{"iteration": 5, "name": "b", "layer": "x", "tensor": "y", "stat": "z", "value": null, '
                 '"nonfinite": "nan"}']
    sink.close()
    assert path.read_text(encoding="utf-8").splitlines() == expected


class Ordered(Sink):
    def __init__(self):
        self.calls = []

    def log_scalar(self, name, value, iteration, *, layer=None, tensor=None, stat=None):
        self.calls.append((name, value, iteration, layer, tensor, stat))


class Plain:
    def __init__(self):
        self.calls = []

    def log_scalar(self, name, value, iteration):
        self.calls.append((name, value, iteration))


def test_text_sink_batches_and_levels(tmp_path):
    path = tmp_path / "stats.log"
    text, ordered, plain = TextStatsSink(str(path)), Ordered(), Plain()
    metrics = MetricLogger()
    for sink in (text, ordered, plain):
        metrics.add_sink(sink)
    records = [("L_activation_min", -1.25, 3, "L", "activation", "min"), ("L_activation_std", math.nan, 3, "L",
                                                                         "activation", "std")]
    metrics.log_scalars(records)
    metrics.log_scalars([])
    text.log_scalar("dropped", 1.0, 3, level=logging.DEBUG)
    text.log_scalar("L_gradient_max", 2.0, 12, level=logging.WARNING)
    metrics.flush()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3
    assert re.fullmatch(ASCTIME + re.escape(" - INFO - L_activation_min" + TABS + "iteration=000003" + TABS
                                            + "value=-1.2500"), lines[0])
    assert lines[1].endswith(" - INFO - L_activation_std" + TABS + "iteration=000003" + TABS + "value=nan")
    assert re.fullmatch(ASCTIME + re.escape(" - WARNING - L_gradient_max" + TABS + "iteration=000012" + TABS
                                            + "value=2.0000"), lines[2])
    assert ordered.calls == records
    assert plain.calls == [r[:3] for r in records]
    metrics.close()
    text.log_scalar("after close", 1.0, 1)  # dropped, as a logger without handlers did
    assert len(path.read_text(encoding="utf-8").splitlines()) == 3
